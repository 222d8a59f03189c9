"""Turns accepted raw runs (data/raw) into the Hub configs (data/<config>), verifies and publishes them."""
