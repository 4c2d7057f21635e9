"""the system a plan runs on, as data: hardware profiles and implementation profiles."""
