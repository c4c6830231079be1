"""callbacks.manifest: the fast package listing gives what importlib.metadata's full parse gives."""

from __future__ import annotations

import importlib.metadata

from callbacks.manifest import installed_packages


def test_installed_packages_match_the_full_metadata_parse() -> None:
    slow = sorted({f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions()
                   if d.metadata["Name"]}, key=str.lower)
    assert installed_packages() == slow
