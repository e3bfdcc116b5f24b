"""The offline feature cache: the target run once over the data, its features stored in shards,
training from them without loading the target."""
