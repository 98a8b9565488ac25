// The elastic agent of one node: joins the job's rendezvous (an etcd, a
// store one agent of the job serves, or, alone, its own), starts this node's
// workers for each round with the environment torchrun and DeepSpeed workers
// expect plus the batch plan of the round's world size, serves their
// TCPStore when it leads, watches them, and re-forms the group when a node
// leaves, a node arrives (and a larger valid world size becomes reachable)
// or a worker fails. See docs/elastic-agent.md.
//
// Threading: run_agent() blocks the calling thread until the job ends; it
// starts helper threads (the lease keep-alive and its fence; a store
// server's when it serves the rendezvous or the workers' store; with a
// stop_signal, one that watches it while the rendezvous is waited for). It
// forks worker processes, so call it from a process whose other threads do
// not hold locks the children would need (the guards call only
// async-signal-safe functions).
// Errors: throws ductile::Error (a user error: exit code 2 in the CLI) for
// invalid options, an invalid configuration, an unreachable etcd at start, a
// port to host that is in use, a job id in use with other settings, or an
// nproc-per-node that no valid world size can use. Failures after the start
// are the return value.
#pragma once

#include "ductile/agent/agent_options.hpp"

namespace ductile::agent {

// Exit statuses of run_agent besides a worker's own status.
inline constexpr int kAgentOk = 0;
// etcd unreachable for store_timeout, or the agent hosting a c10d or
// static rendezvous gone.
inline constexpr int kAgentStoreLost = 1;

inline constexpr int kAgentJoinTimeout = 1;  // no round within join_timeout

// Runs the agent until the job ends. Returns 0 when the workers finished,
// the failing worker's exit status (128 + signal for a signal) when restarts
// are spent, kAgentStoreLost when etcd stayed unreachable, 2 when this node
// cannot start its workers (fork fails: the process limit) or another agent
// took its node id, 128 + signal when stopped by *stop_signal. A stop
// signal while the rendezvous is waited for at the start (or by its host
// at the end), when no worker runs, ends the process itself with
// 128 + signal. The calling process becomes a child subreaper
// (workers.hpp): what its workers leave behind is ended with them.
int run_agent(const AgentOptions& options);

}  // namespace ductile::agent
