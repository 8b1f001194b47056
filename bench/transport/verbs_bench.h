#pragma once
// The verbs mode of the transport benchmark (see verbs_bench.cc for what it measures and its arguments).
// bench_transport_verbs is a thin main around it; bench_transport can dispatch a --verbs mode here as well.

namespace wsync::bench {

// Parses argv (argv[0] is the program name), runs the sweep, prints the table and a final JSON line.
// Returns the process exit code.
int RunVerbsBench(int argc, char** argv);

}  // namespace wsync::bench
