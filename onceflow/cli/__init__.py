"""The `onceflow` command and what only it uses: the subcommands (`main.py`), the demo, the read-only views
(tasks, runs, entries, history), on-demand retention, the trace lines and the protocol reference generator.
Main thread. Importing this package imports nothing else: each subcommand loads its own machinery.
"""
