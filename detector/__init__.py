"""The Xid detector daemon: kernel log and NVML sources, signal-with-start into the incident."""
