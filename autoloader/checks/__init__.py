"""What is checked before any trial: the arguments, the dataset's facts, the machine."""
