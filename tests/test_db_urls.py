"""Every PostgreSQL URL form a user may type reaches the database and migrates it."""

import pytest
from sqlalchemy import text

from tests.conftest import PG_URL
from tokenmill.schemas import storage as S

pytestmark = pytest.mark.postgres


@pytest.mark.parametrize("scheme", ["postgresql", "postgresql+psycopg", "postgresql+psycopg2"])
def test_each_postgresql_url_form_connects_and_migrates(scheme, pg_url):
    url = scheme + pg_url[pg_url.index("://"):]
    eng = S.connect(url)
    try:
        assert eng.dialect.driver == {"postgresql": "psycopg", "postgresql+psycopg": "psycopg",
                                      "postgresql+psycopg2": "psycopg2"}[scheme]
        with eng.connect() as conn:
            assert S.current_revision(conn) == S.head_revision()
            assert conn.execute(text("select count(*) from jobs")).scalar() == 0
    finally:
        eng.dispose()


def test_the_suite_runs_through_the_bare_form():
    assert PG_URL.startswith("postgresql://")
