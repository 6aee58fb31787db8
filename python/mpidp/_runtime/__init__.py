"""The runtime every layer stands on (private): MPI start-up and the
communicator argument (mpi), settings (config), launcher detection
(launch), topology, the ranks' agreements and consistency checks, argument
checks, dtype codes, parameter helpers, and fault-tolerant mode's state and
per-step agreements (fault_tolerant_mode)."""
