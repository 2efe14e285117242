"""Building the DataLoader a setting names: the factory, batched fetch, thread workers."""
