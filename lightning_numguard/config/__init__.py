"""The guard's arguments: their validation, types and documentation."""
