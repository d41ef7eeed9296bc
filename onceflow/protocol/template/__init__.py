"""Workflow templates, Kandev's YAML format: the model (`model`, `actions`), the strict bounded reader
(`parse`), validation into the model (`validate`, `counts`, `problems`), the lint of a valid template (`lint`)
and its JSON Schema (`schema`). `onceflow.protocol.workflow` is the public door: the loaders and every name
a host uses. Pure: no thread of its own.
"""
