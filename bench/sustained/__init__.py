"""`simmer bench sustained`: back-to-back chat requests through the HTTP API on a simulated device, once
governed and once ungoverned, each on the same device starting cold. Prints (and plots) both runs.

The server runs as a child process (`simmer serve` as a user starts it), so the simulated device is heated
by the server's CPU time alone, not by this client. Time axes are simulated seconds; tok/s is real tokens
per wall second (the engine does not run faster because the device's heat capacity is scaled).

How close to the device's limit: the thermal envelope's limit is the busy cores the simulated device
sustains at T_throttle (its steady state, leakage included: DeviceProfile.sustainable_cores) times the best
tokens per CPU-second of the server measured in the same benchmark (process CPU of the server, all threads);
the governor's efficiency is its tok/s over the last 5 minutes over that limit. Mid-reply pauses are what a
user sees: `event: governor` stream events that pause a reply after its first token.

Offline check: the child installs a Python audit hook (PEP 578) that records every socket bind, connect,
sendto and getaddrinfo with its address; the report lists any that is not loopback. This client checks its
own requests the same way.

The modules, by what they do: process (the server as a child), audit (the socket audit), client (one
streamed request), run (one run), measure (what a run measured), modes (governed against ungoverned,
offload against no offload), ladder (the model ladder), plot (the figure).
"""
