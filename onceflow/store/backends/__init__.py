"""The two backends under the store: the connection shape, SQLite's and PostgreSQL's schemas and dialect,
storage faults, the file lock, savepoints, which clock a statement judges by, and epoch liveness. Writer
thread (the lock and URLs are pure or taken at open).
"""
