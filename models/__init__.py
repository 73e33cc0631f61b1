"""Types, constants, the Xid catalog and the pure remediation policy."""
