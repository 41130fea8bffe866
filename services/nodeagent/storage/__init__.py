"""Node-local storage: the btrfs store and its reflinks (store), disk and full snapshots, rollback and fork
(snapshots), snapshot diffs (diff), disk growth (diskgrow), volumes and their files (volumes, volume_content)."""
