"""The unit tier: tests that start no mount, no worker, coordinator or CSI plugin process and no
server process (moto, etcd, a peer) beyond in-process fakes (tests/fakes' OSS server and fault
proxy, trio and HTTP servers in the test's own process). A short-lived command may run (a child
that crashes on purpose, openssl, kubectl's rendering, protoc, ``cachefs --help``).

Mirrors the packages (tests/unit/store/, tests/unit/coordinator/, ...). A package (this file)
so that a test package split across the tiers has one name in each (unit.cluster, e2e.cluster)."""
