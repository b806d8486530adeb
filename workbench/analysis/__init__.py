"""Analysis: pure functions from trace frames to tables, and the analyze and diff commands."""
