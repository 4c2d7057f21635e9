"""many searches at once: sweeps, decision maps, what-ifs and sensitivities."""
