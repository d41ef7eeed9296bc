"""The Trio side of the runtime (every module runs on the Trio thread): actors, the engine, supervision. No
function here takes a database connection and no SQL lives here (store/ owns both; tests/facade/test_layout.py
keeps it so).

- `kernel/`: the actor machinery: mailboxes, the ledger actor, operation locks, the outbox, services.
- `engine/`: what a trigger, a step entry, on_enter, a quorum guard, a WIP promotion and the recovery
  scan decide, planned here and executed by the store.
- `task/`: the task actor and its command handlers.
- `runtime/`: the supervisor, the runtime-level command handlers, start-up, outcome delivery, the epoch
  sweep.
"""
