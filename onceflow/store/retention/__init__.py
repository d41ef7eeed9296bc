"""Retention: deleting resolved history past its time, in bounded batches. Writer thread."""
