"""csbp simulator: workload + plan -> layout -> step graph -> engine -> result. No torch here."""
