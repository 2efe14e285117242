"""The result of a run, its JSON file, and its presenters (report, plot, progress)."""
