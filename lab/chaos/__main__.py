"""``python -m lab.chaos``: see lab/chaos/__init__.py."""

from lab.chaos import main

main()
