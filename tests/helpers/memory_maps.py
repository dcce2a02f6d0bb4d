"""This process's memory mappings as the kernel lists them (/proc/self/smaps)."""

from __future__ import annotations


def vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process holding `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")
