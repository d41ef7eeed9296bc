"""The task actor (Trio thread): one per busy task, serializing the task's commands, and its command
handlers."""
