"""The error the serve routes answer in OpenAI's error shape (app.py turns it into one)."""

from __future__ import annotations


class ApiError(Exception):
    """A refusal the routes turn into OpenAI's error shape."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.code, self.param, self.type = status, code, param, type
