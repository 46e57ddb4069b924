"""The TRL-compatible trainers and their configs."""
