"""measuring a host into a hardware profile."""
