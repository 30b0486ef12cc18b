//! A minimal writer for NumPy's .npy format (version 1.0, little-endian f32), so
//! any reference can read `--dump-logits` output without our code.

use std::io::Write;

pub fn write_f32(
    path: &std::path::Path,
    rows: usize,
    cols: usize,
    data: &[f32],
) -> std::io::Result<()> {
    write_f32_to(std::fs::File::create(path)?, rows, cols, data)
}

/// [`write_f32`] into an open file or any writer (`--dump-logits` creates its file
/// before generating, so a bad path is reported at once).
pub fn write_f32_to(
    out: impl Write,
    rows: usize,
    cols: usize,
    data: &[f32],
) -> std::io::Result<()> {
    assert_eq!(rows * cols, data.len());
    let mut f = std::io::BufWriter::new(out);
    write_header(&mut f, rows, cols)?;
    for v in data {
        f.write_all(&v.to_le_bytes())?;
    }
    f.flush()
}

/// The header of a float32 `[rows, cols]` .npy, for writers that stream the rows after
/// it (each row `cols` little-endian f32s, `rows` of them).
pub fn write_header(out: &mut impl Write, rows: usize, cols: usize) -> std::io::Result<()> {
    let mut header =
        format!("{{'descr': '<f4', 'fortran_order': False, 'shape': ({rows}, {cols}), }}");
    // magic(6) + version(2) + header length(2) + header, padded with spaces and a
    // newline to a multiple of 64 bytes.
    let total = 10 + header.len() + 1;
    let pad = (64 - total % 64) % 64;
    header.push_str(&" ".repeat(pad));
    header.push('\n');
    out.write_all(b"\x93NUMPY\x01\x00")?;
    out.write_all(&(header.len() as u16).to_le_bytes())?;
    out.write_all(header.as_bytes())
}

/// Reads a .npy written by numpy (f32 little-endian, C order, 1-D or 2-D).
pub fn read_f32(path: &std::path::Path) -> std::io::Result<(Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(path)?;
    let bad = |m: &str| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{}: {m}", path.display()),
        )
    };
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return Err(bad("not a .npy file"));
    }
    let (hlen, hstart) = if bytes[6] == 1 {
        (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10)
    } else {
        (
            u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
            12,
        )
    };
    let header = std::str::from_utf8(
        bytes
            .get(hstart..hstart + hlen)
            .ok_or_else(|| bad("truncated header"))?,
    )
    .map_err(|_| bad("header is not UTF-8"))?;
    if !header.contains("'<f4'") || header.contains("'fortran_order': True") {
        return Err(bad("expected little-endian float32 in C order"));
    }
    let shape_s = header
        .split("'shape': (")
        .nth(1)
        .and_then(|s| s.split(')').next())
        .ok_or_else(|| bad("no shape"))?;
    let shape: Vec<usize> = shape_s
        .split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|s| s.trim().parse().map_err(|_| bad("bad shape")))
        .collect::<Result<_, _>>()?;
    let data: Vec<f32> = bytes[hstart + hlen..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    if data.len() != shape.iter().product::<usize>() {
        return Err(bad("data length does not match the shape"));
    }
    Ok((shape, data))
}
