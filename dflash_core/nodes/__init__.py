"""Nodes: reach one (local or SSH), provision it, preserve it before shutdown. No Prefect import.

Importing this package needs no boto3 (S3 is imported where a record or backup is uploaded), so
`python -m dflash_core.nodes provision --local` runs on a bare GPU image.
"""

from dflash_core.nodes.access import (
    CommandFailed, CommandResult, CommandTimeout, DetachedProcess, HostKeyError, NodeAccess, NodeError,
    NodeUnreachable,
)
from dflash_core.nodes.node import Node, find_node, load_inventory, local_node
from dflash_core.nodes.preserve import PROCESS_DIR, PreserveConfig, PreserveResult, preserve
from dflash_core.nodes.provision import (
    ProvisionConfig, ProvisionError, provision, upload_node_record, write_node_record,
)
from dflash_core.nodes.record import NodeRecord, SystemInventory

__all__ = [
    "CommandFailed", "CommandResult", "CommandTimeout", "DetachedProcess", "HostKeyError", "Node", "NodeAccess",
    "NodeError", "NodeRecord", "NodeUnreachable", "PROCESS_DIR", "PreserveConfig", "PreserveResult",
    "ProvisionConfig", "ProvisionError", "SystemInventory", "find_node", "load_inventory", "local_node", "preserve",
    "provision", "upload_node_record", "write_node_record",
]
