"""Turns accepted raw runs (data/raw) into the Hub configs (data/<config>), verifies and publishes them.

* ``builder.build.build(run_dirs, data_dir, card_path, allow_interpret=, replace=)``: accept runs, all or nothing.
* ``builder.verify.verify(data_dir, card_path) -> list[str]``: every problem found (empty: consistent).
* ``builder.publish.publish(root, repo_id, version, dry_run=, stage_dir=, gated=, api=)``: one tagged release.
* ``builder.rules``: the acceptance rules; ``builder.tables``: row layouts; ``builder.card``: generated card parts.
"""
