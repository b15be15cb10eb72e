"""Text out of a model: one sequence (``sampling``), a conversation (``conversation``), many
sequences at once (``batcher``), and over HTTP: requests and replies in native types
(``requests``), the HTTP server and its limits (``server``)."""
