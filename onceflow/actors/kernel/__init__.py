"""The actor machinery (Trio thread): mailboxes, the ledger actor, operation locks, the outbox and what actors
share."""
