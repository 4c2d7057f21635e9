"""runtime against prediction: the suite, its runs, its report and plot."""
