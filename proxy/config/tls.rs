//! TLS material named by the config, read and checked when it is loaded: the listener's
//! certificate chain and key, and an upstream's trust roots (the platform's, plus a PEM
//! bundle). A bad file is a config problem here, never an error at the first connection.

use std::sync::Arc;

use pingora::listeners::tls::{Acceptor, TlsSettings};
use pingora::listeners::ALPN;
use pingora::tls::{load_native_certs, CertificateDer, PrivateKeyDer, ServerConfig};
use pingora::utils::tls::WrappedX509;
use rustls_pki_types::pem::PemObject;

/// The trust roots pingora's connector takes per peer.
pub type Trust = Arc<pingora::protocols::tls::CaType>;

/// pingora's TLS acceptor (HTTP/1.1 only) for the certificate chain in `cert` and the
/// private key in `key`, both checked first: pingora's builder panics on a bad file.
pub(crate) fn acceptor(cert: &str, key: &str) -> Result<Arc<Acceptor>, String> {
    pingora::tls::install_default_crypto_provider();
    let chain = certificates(cert)?;
    let private = PrivateKeyDer::from_pem_file(key)
        .map_err(|e| format!("`{key}` holds no private key: {}", pem_error(&e)))?;
    ServerConfig::builder()
        .with_no_client_auth()
        .with_single_cert(chain, private)
        .map_err(|e| format!("the certificate and key do not make a TLS identity: {e}"))?;
    let mut settings = TlsSettings::intermediate(cert, key).map_err(|e| e.to_string())?;
    settings.set_alpn(ALPN::H1);
    Ok(Arc::new(settings.build()))
}

/// The platform's trust roots (`SSL_CERT_FILE` and `SSL_CERT_DIR` included) with the
/// certificates of the PEM bundle `ca_file` added.
pub(crate) fn trust_with(ca_file: &str) -> Result<Trust, String> {
    let added = certificates(ca_file)?;
    // A platform without a store of its own still trusts the bundle.
    let platform = load_native_certs().unwrap_or_default();
    let roots = platform
        .into_iter()
        .chain(added)
        .filter(|der| x509_parser::parse_x509_certificate(der).is_ok())
        .map(|der| WrappedX509::new(der.to_vec(), pingora::utils::tls::parse_x509))
        .collect::<Vec<_>>();
    Ok(Arc::from(roots.into_boxed_slice()))
}

/// The certificates of a PEM file, each checked to parse; at least one.
fn certificates(path: &str) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| format!("cannot read `{path}`: {}", pem_error(&e)))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("`{path}` is not a PEM certificate file: {}", pem_error(&e)))?;
    if certs.is_empty() {
        return Err(format!("`{path}` holds no PEM certificate"));
    }
    for (i, der) in certs.iter().enumerate() {
        if let Err(e) = x509_parser::parse_x509_certificate(der) {
            return Err(format!(
                "certificate {} of `{path}` does not parse: {e}",
                i + 1
            ));
        }
    }
    Ok(certs)
}

fn pem_error(e: &rustls_pki_types::pem::Error) -> String {
    match e {
        rustls_pki_types::pem::Error::Io(io) => io.to_string(),
        rustls_pki_types::pem::Error::NoItemsFound => "no PEM section found".into(),
        other => format!("{other:?}"),
    }
}
