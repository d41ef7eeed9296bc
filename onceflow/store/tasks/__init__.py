"""Task rows and their compare-and-set step change, registered workflow versions, moving tasks between
versions, and a task's history. Writer thread.
"""
