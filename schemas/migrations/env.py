"""Alembic environment: the tables are tokenmill.schemas.tables.metadata."""

from alembic import context

from tokenmill.schemas.tables import metadata

config = context.config
connection = config.attributes.get("connection")
if connection is None:  # `alembic` run from the command line with sqlalchemy.url set
    from sqlalchemy import create_engine

    with create_engine(config.get_main_option("sqlalchemy.url", "")).begin() as connection:
        context.configure(connection=connection, target_metadata=metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()
else:
    context.configure(connection=connection, target_metadata=metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()
