"""What holds and changes training state: verified-finite snapshots, their adapters and shards, the quarantine, and
recovery (the only part that changes training state). Torch and the standard library only."""
