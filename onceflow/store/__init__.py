"""The store: the writer thread, every SQL statement, both backends. Every function that takes a
connection runs on the writer thread inside the writer's transaction (store/writer.py).
"""
