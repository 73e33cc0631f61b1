"""Entry points: build clients from settings and run a Temporal worker. Nothing imports this room."""
