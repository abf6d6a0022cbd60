"""The record a partial copy (the share of a step some ranks read) keeps of itself, in the
copy's directory: its file name and format. Reading and writing it: transfer/engine/share.py;
what a partial copy may and may not be used for: agent/hotdir.py."""

SHARE_MARKER = ".ferry-share.json"
SHARE_FORMAT = "ckpt-ferry-share"
SHARE_VERSION = 1
