"""Example jobs a researcher would submit with sbatch."""
