"""The daemon core and what it owns: the ledger, the admission policy, the device and the registry file."""
