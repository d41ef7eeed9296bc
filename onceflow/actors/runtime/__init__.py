"""The runtime (Trio thread): its supervisor, its own command handlers, start-up, outcome delivery and the
epoch sweep."""
