"""Turns accepted raw runs (data/raw) into the Hub configs (data/<config>), verifies and publishes them.

Imports point down only: ``bench`` (to recompute a run's numbers) and ``records`` (raw-run I/O, the
release schemas, the secret scanner); never the loading script, so ``datasets`` is imported only
where the card's ``dataset_info`` YAML is written with its own API.

* ``builder.build.build(run_dirs, data_dir, card_path, allow_interpret=, replace=)``: accept runs, all or
  nothing, under a lock.
* ``builder.verify.verify(data_dir, card_path) -> list[str]``: every problem found (empty: consistent),
  secret-shaped values included.
* ``builder.publish.publish(root, repo_id, version=None, private=, dry_run=, stage_dir=, gated=, api=)``:
  one tagged release; ``HubError`` carries each Hub failure's exit status.
* ``builder.rules``: the acceptance rules; ``builder.recompute``: a measured run's numbers re-derived;
  ``builder.tables``: row layouts; ``builder.card``: generated card parts; ``builder.grader_power``:
  a grader-power summary as a record.
"""
