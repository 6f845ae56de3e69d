"""Spill stores for session caches (SQLite, Redis, any SQLAlchemy URL)."""
