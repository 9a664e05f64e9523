"""Writers: a shard plan (or the checkpoint itself) -> the artifact's files, one per format."""
