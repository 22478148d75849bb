"""Errors of the trajectory store. Each names the field, unit or value at fault."""


class StoreError(Exception):
  """Base class of every error the store raises."""


class TrajectoryValidationError(StoreError, ValueError):
  """An appended trajectory is malformed; nothing of that append call was written."""

  def __init__(self, field: str, index: int, value, reason: str, group_id=None):
    self.field, self.index, self.value, self.reason = field, index, value, reason
    where = f"trajectory {index}" + (f" (group {group_id})" if group_id is not None else "")
    super().__init__(f"{where}: field '{field}' = {_short(value)}: {reason}")


class CorruptUnitError(StoreError):
  """A storage unit's stored data is truncated, missing or inconsistent."""

  def __init__(self, unit: str, detail: str):
    self.unit, self.detail = unit, detail
    super().__init__(f"storage unit '{unit}' is corrupt or truncated: {detail}")


class UnknownUnitError(StoreError, KeyError):
  def __init__(self, unit: str, root: str):
    self.unit = unit
    super().__init__(f"no storage unit '{unit}' in store {root}")

  def __str__(self):  # KeyError would quote the whole message
    return self.args[0]


class SchemaMismatchError(StoreError, ValueError):
  """A store is opened with a schema that differs from the one it was created with."""


def _short(value, limit: int = 80) -> str:
  text = repr(value)
  return text if len(text) <= limit else text[:limit] + "..."
