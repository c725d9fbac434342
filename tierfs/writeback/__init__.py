"""Write-back: unsaved writes, their upload to the object store, and the journal.

One concern per module (docs/architecture.md, "File states", has the state table):
  files.py     WriteBack: the owner of every file being written and of its state
  dirty.py     DirtyFile, its states and allowed transitions; the staging-file helpers
  upload.py    Uploader: PUT, multipart, parts streamed while a file is written
  queue.py     UploadQueue: which file next, each failed file's own backoff
  orphans.py   Uploads: the multipart uploads this daemon owns; cleanup of the others
  settle.py    Settler: what was uploaded stays cached, once
  recovery.py  journaled files after a crash; pending uploads at shutdown
"""

from .dirty import DirtyFile, State
from .files import WriteBack

__all__ = ["DirtyFile", "State", "WriteBack"]
