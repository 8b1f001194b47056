// Certificate rotation without a restart (docs/security.md, "Certificate rotation"), against a real coordinator
// process whose TLS files live in a directory laid out like a mounted Kubernetes Secret (files are links through
// "..data", which an update swaps atomically to a new version directory), refreshed every second:
//   * after a rotation to certificate B (same CA, new key and serial) and to a CA bundle holding a second CA, new
//     connections see B (the peer certificate presented in the handshake is compared with the file) and callers
//     with certificates of the second CA are accepted; authorization by CN still allows and refuses by role;
//   * broken replacements (not PEM, expired, signed by a CA outside the bundle, a key of another certificate, another
//     identity) are rejected with an error naming the file, and the server keeps serving B; a valid one after them
//     is taken;
//   * a process started with an expired certificate exits 2 naming the file; one whose certificate expires within a
//     day warns that no replacement was found;
//   * a wsync client (tls::Dial in this process) verifies the server's name, and presents its own rotated
//     certificate on new connections.
// Certificates are minted by tools/cli/wsync-certs.sh (openssl); the test's own channels use gRPC's plain SSL
// credentials, not the code under test.

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "proto/tls.h"
#include "proto/tls_files.h"
#include "tests/daemon/cluster.h"
#include "wsync/v1/coordinator.grpc.pb.h"

namespace wsync {
namespace {

using testing::ReadFile;

const char* kBin = WSYNC_BIN_DIR;
const char* kCertsScript = WSYNC_CERTS_SCRIPT;

void Sh(const std::string& cmd) {
  INFO(cmd);
  REQUIRE(std::system(cmd.c_str()) == 0);
}

std::string Strip(const std::string& pem) {
  std::string s;
  for (char c : pem)
    if (c != '\n' && c != '\r' && c != ' ') s.push_back(c);
  return s;
}

// The first certificate of a PEM file (the leaf of a chain).
std::string Leaf(const std::string& pem) {
  const std::string end = "-----END CERTIFICATE-----";
  const size_t e = pem.find(end);
  return e == std::string::npos ? pem : pem.substr(0, e + end.size());
}

// A Secret-like directory: DIR/{ca.crt,tls.crt,tls.key} -> DIR/..data/<same> and ..data -> ..vN.
struct SecretDir {
  std::string dir;
  int version = 0;
  std::string ca() const { return dir + "/ca.crt"; }
  std::string cert() const { return dir + "/tls.crt"; }
  std::string key() const { return dir + "/tls.key"; }
  void Publish(const std::string& ca_pem, const std::string& cert_pem, const std::string& key_pem) {
    const std::string v = absl::StrCat("..v", ++version);
    Sh(absl::StrCat("mkdir -p ", dir, "/", v));
    for (const auto& [name, content] :
         {std::pair<std::string, std::string>{"ca.crt", ca_pem}, {"tls.crt", cert_pem}, {"tls.key", key_pem}}) {
      std::FILE* f = std::fopen(absl::StrCat(dir, "/", v, "/", name).c_str(), "w");
      REQUIRE(f != nullptr);
      std::fwrite(content.data(), 1, content.size(), f);
      std::fclose(f);
    }
    // The kubelet's swap: a new link renamed over ..data (one atomic rename).
    Sh(absl::StrCat("ln -sfn ", v, " ", dir, "/..data_tmp && mv -T ", dir, "/..data_tmp ", dir, "/..data"));
    if (version == 1)
      for (const char* name : {"ca.crt", "tls.crt", "tls.key"})
        Sh(absl::StrCat("ln -s ..data/", name, " ", dir, "/", name));
  }
};

struct Identity {
  std::string ca, cert, key;  // PEM contents
};
Identity Load(const std::string& dir, const std::string& name) {
  return {ReadFile(dir + "/ca.pem"), ReadFile(dir + "/" + name + ".pem"), ReadFile(dir + "/" + name + "-key.pem")};
}

// A fresh connection (its own subchannel) as `id`, trusting `trust` (CA PEM).
std::unique_ptr<v1::Coordinator::Stub> Stub(const std::string& addr, const Identity& id, const std::string& trust) {
  grpc::SslCredentialsOptions o;
  o.pem_root_certs = trust;
  o.pem_cert_chain = id.cert;
  o.pem_private_key = id.key;
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return v1::Coordinator::NewStub(grpc::CreateCustomChannel(addr, grpc::SslCredentials(o), args));
}

struct Result {
  grpc::Status status;
  std::string peer_pem;  // the certificate the server presented
};

Result Status(v1::Coordinator::Stub& stub) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::ClusterStatusRequest req;
  v1::ClusterStatus resp;
  Result r;
  r.status = stub.GetClusterStatus(&ctx, req, &resp);
  if (auto auth = ctx.auth_context()) {
    auto pem = auth->FindPropertyValues("x509_pem_cert");
    if (!pem.empty()) r.peer_pem = std::string(pem.front().data(), pem.front().size());
  }
  return r;
}

grpc::Status Abort(v1::Coordinator::Stub& stub) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::AbortUpdateRequest req;
  v1::AbortUpdateReply resp;
  return stub.AbortUpdate(&ctx, req, &resp);
}

bool WaitFor(const std::function<bool()>& cond, std::chrono::seconds limit) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    if (cond()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return cond();
}

TEST_CASE("tls rotation: a running coordinator takes rotated files, rejects broken ones, clients rotate too") {
  const auto t0 = std::chrono::steady_clock::now();
  char tmpl[] = "/tmp/wsync-tls-rotation.XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  INFO("files and logs in " << dir);
  const std::string ca1 = dir + "/ca1", ca2 = dir + "/ca2", ca3 = dir + "/ca3";
  Sh(absl::StrCat(kCertsScript, " ", ca1, " coordinator:main admin:ops trainer:t0 >/dev/null"));
  const Identity cert_a = Load(ca1, "coordinator-main");
  Sh(absl::StrCat(kCertsScript, " ", ca1, " coordinator:main >/dev/null"));  // B: same CA, new key and serial
  const Identity cert_b = Load(ca1, "coordinator-main");
  Sh(absl::StrCat(kCertsScript, " --days -1 ", ca1, " coordinator:main >/dev/null"));  // expired yesterday
  const Identity expired = Load(ca1, "coordinator-main");
  Sh(absl::StrCat(kCertsScript, " ", ca1, " coordinator:main >/dev/null"));  // D: taken after the broken ones
  const Identity cert_d = Load(ca1, "coordinator-main");
  const Identity admin1 = Load(ca1, "admin-ops"), trainer1 = Load(ca1, "trainer-t0");
  Sh(absl::StrCat(kCertsScript, " ", ca2, " admin:ops >/dev/null"));
  const Identity admin2 = Load(ca2, "admin-ops");
  Sh(absl::StrCat(kCertsScript, " ", ca3, " coordinator:main admin:ops >/dev/null"));  // a CA the server never trusts
  const Identity foreign = Load(ca3, "coordinator-main"), admin3 = Load(ca3, "admin-ops");
  REQUIRE(Strip(cert_a.cert) != Strip(cert_b.cert));
  const std::string both_cas = cert_a.ca + admin2.ca;

  // At start the same checks apply: an expired certificate is refused, naming the file (exit 2).
  {
    SecretDir bad{dir + "/expired"};
    bad.Publish(expired.ca, expired.cert, expired.key);
    const std::string bad_log = dir + "/expired.log";
    testing::Process p({std::string(kBin) + "/wsync-coordinator", "--listen", "127.0.0.1:0", "--tls-ca", bad.ca(),
                        "--tls-cert", bad.cert(), "--tls-key", bad.key()},
                       bad_log);
    CHECK(p.Wait(std::chrono::seconds(20)) == 2);
    CHECK(absl::StrContains(ReadFile(bad_log), "--tls-cert " + bad.cert() + ": expired on"));
  }

  // A certificate that expires within a day, with no replacement in sight, is warned about.
  {
    Sh(absl::StrCat(kCertsScript, " --days 1 ", ca1, " coordinator:soon >/dev/null"));
    const std::string soon_log = dir + "/soon.log";
    testing::Process p(
        {std::string(kBin) + "/wsync-coordinator", "--listen", "127.0.0.1:0", "--tls-ca", ca1 + "/ca.pem", "--tls-cert",
         ca1 + "/coordinator-soon.pem", "--tls-key", ca1 + "/coordinator-soon-key.pem", "--tls-refresh-seconds", "1"},
        soon_log);
    CHECK(WaitFor([&] { return absl::StrContains(ReadFile(soon_log), "no replacement was found in " + ca1); },
                  std::chrono::seconds(10)));
    CHECK(absl::StrContains(ReadFile(soon_log), "coordinator:soon"));
  }

  SecretDir secret{dir + "/server"};
  secret.Publish(cert_a.ca, cert_a.cert, cert_a.key);
  const std::string log = dir + "/coordinator.log", port_file = dir + "/coordinator.port";
  testing::Process coord(
      {std::string(kBin) + "/wsync-coordinator", "--listen", "0.0.0.0:0", "--port-file", port_file, "--tls-ca",
       secret.ca(), "--tls-cert", secret.cert(), "--tls-key", secret.key(), "--tls-refresh-seconds", "1"},
      log);
  REQUIRE(WaitFor([&] { return !ReadFile(port_file).empty() && ReadFile(port_file).back() == '\n'; },
                  std::chrono::seconds(30)));
  std::string port = ReadFile(port_file);
  port.pop_back();
  const std::string addr = "127.0.0.1:" + port;
  INFO("coordinator log: " << log << " (kept when the test fails)");

  // Before: A, CA1 only.
  auto long_lived = Stub(addr, admin1, cert_a.ca);
  Result r = Status(*long_lived);
  REQUIRE(r.status.ok());
  CHECK(Strip(r.peer_pem) == Strip(Leaf(cert_a.cert)));
  CHECK(Status(*Stub(addr, admin2, both_cas)).status.error_code() == grpc::StatusCode::UNAVAILABLE);

  // Rotate to B and to the bundle CA1+CA2.
  const auto rotate_start = std::chrono::steady_clock::now();
  secret.Publish(both_cas, cert_b.cert, cert_b.key);
  REQUIRE(WaitFor([&] { return Strip(Status(*Stub(addr, admin1, cert_a.ca)).peer_pem) == Strip(Leaf(cert_b.cert)); },
                  std::chrono::seconds(10)));
  const double rotate_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - rotate_start).count();
  CHECK(absl::StrContains(ReadFile(log), "TLS: reloaded coordinator:main"));
  // The second CA is trusted now; roles still come from the CN.
  REQUIRE(WaitFor([&] { return Status(*Stub(addr, admin2, both_cas)).status.ok(); }, std::chrono::seconds(5)));
  const grpc::Status admin_abort = Abort(*Stub(addr, admin2, both_cas));
  CHECK(admin_abort.error_code() != grpc::StatusCode::PERMISSION_DENIED);
  CHECK(admin_abort.error_code() != grpc::StatusCode::UNAVAILABLE);
  const grpc::Status trainer_abort = Abort(*Stub(addr, trainer1, cert_a.ca));
  CHECK(trainer_abort.error_code() == grpc::StatusCode::PERMISSION_DENIED);
  CHECK(absl::StrContains(trainer_abort.error_message(), "refused for trainer:t0"));
  // A client without a certificate is still refused at the handshake.
  CHECK(Status(*Stub(addr, Identity{cert_a.ca, "", ""}, cert_a.ca)).status.error_code() ==
        grpc::StatusCode::UNAVAILABLE);
  CHECK(Status(*long_lived).status.ok());  // a channel opened before the rotation keeps working

  // Broken replacements: each rejected with an error naming the file; B keeps serving.
  struct Broken {
    const char* what;
    std::string ca, cert, key, error;
  };
  const std::vector<Broken> broken = {
      {"not PEM", both_cas, "this is not a certificate\n", cert_b.key, "--tls-cert " + secret.cert() + ": no PEM"},
      {"expired", both_cas, expired.cert, expired.key, "--tls-cert " + secret.cert() + ": expired on"},
      {"CA outside the bundle", both_cas, foreign.cert, foreign.key,
       "--tls-cert " + secret.cert() + ": does not verify against the CA bundle --tls-ca " + secret.ca()},
      {"key of another certificate", both_cas, cert_d.cert, cert_b.key,
       "--tls-key " + secret.key() + ": does not match the certificate"},
      {"another identity", both_cas, admin1.cert, admin1.key, "is not the running identity \"coordinator:main\""},
      {"empty CA bundle", "", cert_b.cert, cert_b.key, "--tls-ca " + secret.ca() + ": no PEM certificate"},
  };
  for (const auto& b : broken) {
    INFO("broken replacement: " << b.what);
    secret.Publish(b.ca, b.cert, b.key);
    CHECK(WaitFor([&] { return absl::StrContains(ReadFile(log), b.error); }, std::chrono::seconds(10)));
    std::this_thread::sleep_for(std::chrono::milliseconds(1200));  // past the provider's own 1 s check
    Result after = Status(*Stub(addr, admin1, cert_a.ca));
    CHECK(after.status.ok());
    CHECK(Strip(after.peer_pem) == Strip(Leaf(cert_b.cert)));
  }
  // A valid replacement after all that is taken.
  secret.Publish(both_cas, cert_d.cert, cert_d.key);
  CHECK(WaitFor([&] { return Strip(Status(*Stub(addr, admin1, cert_a.ca)).peer_pem) == Strip(Leaf(cert_d.cert)); },
                std::chrono::seconds(10)));

  // The wsync client side (tls::Dial): the server must name the dialled address (127.0.0.2 is not in its SANs),
  // and the client's own certificate rotates on new connections.
  SecretDir client{dir + "/client"};
  client.Publish(admin1.ca, admin1.cert, admin1.key);
  tls::Options o;
  o.ca = client.ca();
  o.cert = client.cert();
  o.key = client.key();
  o.refresh_seconds = 1;
  REQUIRE(tls::Configure(o, {addr}).ok());
  auto call = [&](const std::string& a) {
    auto ch = tls::Dial(a);
    REQUIRE(ch.ok());
    auto stub = v1::Coordinator::NewStub(*ch);
    return Status(*stub);
  };
  CHECK(call(addr).status.ok());
  const Result wrong_name = call("127.0.0.2:" + port);
  CHECK(wrong_name.status.error_code() == grpc::StatusCode::UNAVAILABLE);
  // Rotate the client to a certificate of CA3 (its bundle CA1+CA3, so it still trusts the server): the server
  // trusts CA1+CA2 only, so new connections fail, which shows they present the new certificate.
  client.Publish(admin1.ca + admin3.ca, admin3.cert, admin3.key);
  CHECK(WaitFor([&] { return call(addr).status.error_code() == grpc::StatusCode::UNAVAILABLE; },
                std::chrono::seconds(10)));
  CHECK(tls::Files()->counters().reloads == 1);
  CHECK(tls::Files()->current().common_name == "admin:ops");
  // And back to CA1's certificate: accepted again.
  client.Publish(admin1.ca, admin1.cert, admin1.key);
  CHECK(WaitFor([&] { return call(addr).status.ok(); }, std::chrono::seconds(10)));

  coord.Stop();
  const double total_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf(
      "tls rotation: server took B %.1f s after the swap (refresh 1 s); %zu broken replacements rejected; "
      "%.1f s in all\n",
      rotate_s, broken.size(), total_s);
  if (std::getenv("WSYNC_TEST_KEEP") == nullptr) std::system(("rm -rf " + dir).c_str());
}

}  // namespace
}  // namespace wsync
