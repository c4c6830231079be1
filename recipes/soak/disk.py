"""The ``disk_full`` fault's disk: a small tmpfs over the runs root that the soak can fill to the last byte.

Mounting needs root or CAP_SYS_ADMIN; where ``mount`` is not permitted the soak skips the kind and says so.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path


class Disk:
    """A tmpfs mounted over the runs root, so that the soak can fill it (root or CAP_SYS_ADMIN only)."""

    def __init__(self, root: Path, size_mb: int) -> None:
        self.root, self.size_mb = root, size_mb
        self.mounted = False
        self.ballast = root / ".chaos-ballast"

    def mount(self) -> str | None:
        """Mount it; the reason it could not be, or None."""
        self.root.mkdir(parents=True, exist_ok=True)
        if shutil.which("mount") is None:
            return "no mount command"
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size_mb}m,mode=0755", "tmpfs",
                                 str(self.root)], capture_output=True, text=True)
        if result.returncode != 0:
            return f"mount -t tmpfs not permitted: {(result.stderr or result.stdout).strip()[:200]}"
        self.mounted = True
        return None

    def fill(self) -> int:
        """Write ballast until the filesystem is full; bytes written."""
        written = 0
        with open(self.ballast, "ab", buffering=0) as handle:
            for chunk in (1 << 20, 1 << 12, 1):
                block = b"\0" * chunk
                try:
                    while True:
                        written += handle.write(block)
                except OSError:
                    continue
        return written

    def free(self) -> None:
        self.ballast.unlink(missing_ok=True)

    def unmount(self) -> None:
        if self.mounted:
            self.free()
            if subprocess.run(["umount", str(self.root)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(self.root)], capture_output=True)
            self.mounted = False
