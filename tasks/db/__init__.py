"""specdec's database: SQLAlchemy models (the schema), Alembic migrations and engines."""

from .engine import (VERSION_TABLE, current_revision, display_url, dispose_engines, ensure_ready,
                     get_engine, head_revision, resolve_database_url, upgrade)
from .models import Base

__all__ = ["Base", "VERSION_TABLE", "current_revision", "display_url", "dispose_engines",
           "ensure_ready", "get_engine", "head_revision", "resolve_database_url", "upgrade"]
