"""WsyncError: every failing call surfaces as one, with the absl/gRPC status code."""

CODE_NAMES = {
    0: "OK", 1: "CANCELLED", 2: "UNKNOWN", 3: "INVALID_ARGUMENT", 4: "DEADLINE_EXCEEDED", 5: "NOT_FOUND",
    6: "ALREADY_EXISTS", 7: "PERMISSION_DENIED", 8: "RESOURCE_EXHAUSTED", 9: "FAILED_PRECONDITION", 10: "ABORTED",
    11: "OUT_OF_RANGE", 12: "UNIMPLEMENTED", 13: "INTERNAL", 14: "UNAVAILABLE", 15: "DATA_LOSS",
    16: "UNAUTHENTICATED",
}

OK = 0
INVALID_ARGUMENT = 3
DEADLINE_EXCEEDED = 4
NOT_FOUND = 5
PERMISSION_DENIED = 7
FAILED_PRECONDITION = 9
ABORTED = 10
UNAVAILABLE = 14
DATA_LOSS = 15


class WsyncError(Exception):
    """A wsync call failed. `code` is the absl::StatusCode number, `code_name` its name, `message` the text."""

    def __init__(self, code: int, message: str):
        self.code = int(code)
        self.code_name = CODE_NAMES.get(self.code, str(self.code))
        self.message = message
        super().__init__("%s: %s" % (self.code_name, message))


def from_rpc_error(err, what: str = "") -> WsyncError:
    """A WsyncError from a grpc.RpcError, with `what` (the call) in front of the server's message."""
    code = err.code()
    num = code.value[0] if code is not None else 2
    details = err.details() or (code.name if code is not None else "unknown error")
    return WsyncError(num, "%s: %s" % (what, details) if what else details)
