"""MODEL -> one open checkpoint: a folder or a Hub id resolved to one commit (hub.py), its files checked
against each other (consistency.py), its family found and its model built once (resolve.py)."""
