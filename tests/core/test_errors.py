"""errors.py: every bad input ends in one `error:` line (entry_point), memory refused and a full
disk are told apart from a damaged file (out_of_memory, disk_full), and a library's message of
several lines becomes one (one_line)."""
import errno

import pytest

from minimedusa.errors import UserError, disk_full, entry_point, one_line, out_of_memory


def test_a_user_error_ends_the_command_in_one_line():
    @entry_point
    def main():
        raise UserError("--prompts questions.txt: the file holds no prompt\n(more detail)")
    with pytest.raises(SystemExit) as end:
        main()
    assert end.value.code == "error: --prompts questions.txt: the file holds no prompt | " \
                             "(more detail)"


def test_a_full_disk_is_told_apart_from_other_write_failures():
    assert disk_full(OSError(errno.ENOSPC, "No space left on device")) == \
        "No space left on device"
    assert disk_full(RuntimeError("SafetensorError: No space left on device (os error 28)")) \
        == "No space left on device"
    assert disk_full(OSError(errno.EACCES, "Permission denied")) is None
    assert disk_full(ValueError("not a GGUF file")) is None


def test_memory_refused_is_told_apart_from_a_damaged_file():
    assert out_of_memory(MemoryError())
    assert out_of_memory(OSError(errno.ENOMEM, "Cannot allocate memory"))
    assert not out_of_memory(OSError(errno.ENOENT, "No such file or directory"))


def test_a_message_of_several_lines_is_one():
    assert one_line("  first\n\n second  \n") == "first | second"
