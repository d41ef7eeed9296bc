"""Step entries and what their admission writes: the compare-and-set admission, the common entry, per-action
markers and segments, the built-in executors, WIP, decisions and seats, code reviews, the recovery scan's
statements (on-enter-action-dispatch.md). Writer thread.
"""
